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
tensor-parallel, :mod:`jaxdist.comm.tensor_parallel`) and over the ``fsdp`` axis (where
FSDP and ZeRO-1 keep each device's slice of the state). Where no rule names ``fsdp``, FSDP
and ZeRO-1 split each device's tensor block over the ``fsdp`` axis (or the data axes) by the
shape rule of :mod:`jaxdist.training.sharding`: the first dimension the shard count
divides. Where one does, every parameter follows the rules, and a parameter with no
dimension mapped to ``fsdp`` stays whole on the axis (MaxText's semantics). On a mesh with
a ``tensor`` axis the default rules (:data:`DEFAULT_RULES`, Megatron's split) follow the
recipe's, so ``embed=fsdp`` alone places the model width over ``fsdp`` and heads and MLP
units over ``tensor``; a dimension the model computes tensor-parallel must land on
``tensor`` (refused in one line otherwise: the model would sum whole products). A model
whose embedding, head and loss can split the vocabulary names it
(:attr:`LogicalAxes.vocabulary`); ``vocab=tensor`` then splits it, and it stays whole (or
follows the ``fsdp`` rules) otherwise.
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
    "check_tensor_split",
    "mesh_axes",
    "names_axis",
    "parse_rules",
    "split_dims",
]

Rules = tuple[tuple[str, str | None], ...]

# Roles a rule may split a parameter's dimension over.
RULE_AXES = ("tensor", "fsdp")
# The leading dimension of scanned layers' stacked parameters.
LAYERS = "layers"

# Megatron's split: attention heads and the MLP's hidden units over the tensor axis.
DEFAULT_RULES: Rules = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"))


@dataclass(frozen=True)
class LogicalAxes:
    """A model's named dimensions.

    Attributes:
      names: a tree like the parameters: per leaf, a tuple with one name (or None) per
        dimension.
      tensor_parallel: the names whose dimensions the model computes tensor-parallel on a
        ``tensor`` axis; a rule must map them to ``tensor`` there.
      vocabulary: the name of the vocabulary's dimension, if the model can also compute its
        embedding, head and loss with the vocabulary split over ``tensor``
        (:mod:`jaxdist.comm.vocab_parallel`) where a rule maps it there; None otherwise.
    """

    names: Any
    tensor_parallel: tuple[str, ...]
    vocabulary: str | None = None

    @property
    def tensor_splittable(self) -> tuple[str, ...]:
        """Every name a rule may map to ``tensor``."""
        return self.tensor_parallel + ((self.vocabulary,) if self.vocabulary else ())

    def splits_vocabulary(self, rules: Rules) -> bool:
        """Whether ``rules`` place the vocabulary over ``tensor``."""
        return self.vocabulary is not None and mesh_axes((self.vocabulary,), rules) == ("tensor",)


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
    not split over, an axis the mesh lacks, the stacked layers' dimension, or ``tensor``
    for a name the model does not compute tensor-parallel."""
    for name, axis in rules:
        if axis is None:
            continue
        if axis not in RULE_AXES:
            raise ValueError(
                f"logical_axis_rules: {name}={axis}: the rules split parameters "
                f"over {' or '.join(RULE_AXES)} only (the other axes split the batch)"
            )
        if name == LAYERS:
            raise ValueError(
                f"logical_axis_rules: {name}={axis}: scanned layers are gathered one "
                "layer at a time, so each device keeps a slice of every layer: map a "
                "dimension inside the layer instead"
            )
        if axis not in mesh_axes_present:
            raise ValueError(
                f"logical_axis_rules: {name}={axis} names an axis the mesh lacks "
                f"(its axes: {', '.join(mesh_axes_present)})"
            )
        if axis == "tensor" and name not in axes.tensor_splittable:
            raise ValueError(
                f"logical_axis_rules: {name}=tensor, but the model computes only "
                f"{', '.join(axes.tensor_splittable)} tensor-parallel"
            )


def check_tensor_split(names: Any, rules: Rules, tensor_parallel: Sequence[str]) -> None:
    """One line for a parameter dimension the model computes tensor-parallel (a name in
    ``tensor_parallel``) that ``rules`` do not place over ``tensor``: the model would sum
    whole products over the axis."""

    def check(path, leaf_names):
        for name, axis in zip(leaf_names, mesh_axes(leaf_names, rules)):
            if name in tensor_parallel and axis != "tensor":
                where = jax.tree_util.keystr(path, simple=True, separator=".")
                raise ValueError(
                    f"logical_axis_rules place {name} over {axis or 'no axis'} ({where}), "
                    f"but on a tensor axis the model computes "
                    f"{', '.join(tensor_parallel)} split over it: map them to tensor"
                )

    jax.tree_util.tree_map_with_path(check, names, is_leaf=_is_names)


def names_axis(rules: Rules, axis: str) -> bool:
    """Whether any of ``rules`` maps a name to ``axis``."""
    return any(rule_axis == axis for _, rule_axis in rules)


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
