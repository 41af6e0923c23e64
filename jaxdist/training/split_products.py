"""A parameter split over a mesh axis is multiplied only by the products that sum over it.

A step that splits parameters over an axis (tensor parallelism,
:mod:`jaxdist.comm.tensor_parallel`) hands the loss each device's block of them. A plain
product over such a block (``nnx.Linear``, ``jnp.dot``, a sum over the split dimension)
computes one device's part and takes it for the whole, and its backward leaves the input's
gradient unsummed: the step would train, silently wrong. So before a split step first
compiles, its loss is traced once on the blocks and the traced program is read
(:func:`check_split_products`): each split parameter is followed through the operations that
carry its split dimension (casts, reshapes, transposes, slices, elementwise arithmetic,
scans, calls), and the step is refused, in one line naming the parameter and the product,
where

* a matrix product or a convolution takes the parameter itself (up to a cast or a
  reshape): it is not one of the products that sum over the axis; or
* a product contracts, or a reduction sums, a value along the parameter's split dimension.

The products that do sum over the axis (:func:`~jaxdist.comm.tensor_parallel.column_product`,
:func:`~jaxdist.comm.tensor_parallel.row_product`, the vocabulary's embedding and loss) run
inside :data:`SPLIT_SCOPE`, and what happens inside it is theirs. An operation the reader does
not know ends the trail there: the check refuses only what it is sure of.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
from jax.extend import core

from jaxdist.comm.scopes import SPLIT_SCOPE

__all__ = ["SplitProductError", "check_split_products"]


class SplitProductError(ValueError):
    """A split parameter reaches a product or a sum that does not sum over its axis."""


@dataclasses.dataclass(frozen=True)
class _Trail:
    """What a value carries of one split parameter: the parameter's name, the value's
    dimensions that hold the split, and whether the value is the parameter itself (up to a
    cast, reshape, transpose or slice)."""

    path: str
    dims: frozenset[int]
    raw: bool

    def moved(self, dims: Sequence[int], raw: bool | None = None) -> _Trail | None:
        kept = frozenset(d for d in dims if d is not None and d >= 0)
        if not kept:
            return None
        return _Trail(self.path, kept, self.raw if raw is None else raw)


def check_split_products(
    loss_fn: Callable,
    params: Any,
    split_dims: Any,
    args: Sequence[Any],
    axis: str,
    axis_sizes: dict[str, int],
) -> None:
    """Refuse, in one line, a loss that multiplies or sums a parameter split over ``axis``
    without summing over the axis (see the module docstring).

    Args:
      loss_fn: ``loss_fn(params, *args)``, the step's loss.
      params: one device's parameter blocks, as arrays or shapes.
      split_dims: a tree like ``params``: the dimension of each leaf split over ``axis``, or
        None (whole).
      args: the loss's other arguments, as arrays or shapes (one device's batch).
      axis: the mesh axis the parameters are split over (named in the message).
      axis_sizes: every mesh axis's size, for the collectives the loss traces.
    """
    closed = jax.make_jaxpr(loss_fn, axis_env=list(axis_sizes.items()))(params, *args)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    dims = jax.tree.structure(params).flatten_up_to(split_dims)
    trails: list[_Trail | None] = []
    for (path, _), dim in zip(flat, dims):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        trails.append(None if dim is None else _Trail(name, frozenset({dim}), True))
    others = len(closed.jaxpr.invars) - len(trails)
    _walk(closed.jaxpr, trails + [None] * others, axis)


# --------------------------------------------------------------------------- the reading

# Operations that hand the parameter on as it is (the value keeps being "the parameter").
_VIEWS = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"}
_PRODUCTS = {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
}
_SCANS_ALONG = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}


def _walk(jaxpr: core.Jaxpr, trails: list[_Trail | None], axis: str) -> list[_Trail | None]:
    """The trails of ``jaxpr``'s outputs given its inputs'; raises where one ends wrong."""
    env: dict[core.Var, _Trail] = {}
    for var, trail in zip(jaxpr.invars, trails):
        if trail is not None:
            env[var] = trail
    for eqn in jaxpr.eqns:
        inputs = [None if isinstance(v, core.Literal) else env.get(v) for v in eqn.invars]
        if not any(inputs) or SPLIT_SCOPE in str(eqn.source_info.name_stack):
            continue
        for var, trail in zip(eqn.outvars, _through(eqn, inputs, axis)):
            if trail is not None and not isinstance(var, core.DropVar):
                env[var] = trail
    return [None if isinstance(v, core.Literal) else env.get(v) for v in jaxpr.outvars]


def _through(eqn: core.JaxprEqn, inputs: list[_Trail | None], axis: str) -> list[_Trail | None]:
    """The outputs' trails of one operation with at least one input on a trail."""
    name = eqn.primitive.name
    out_ndim = [getattr(v.aval, "ndim", 0) for v in eqn.outvars]
    first = next(t for t in inputs if t is not None)
    if name in _PRODUCTS:
        return [_product(eqn, inputs, axis)]
    if name in _REDUCTIONS:
        reduced = set(eqn.params["axes"])
        if reduced & first.dims:
            _refuse(eqn, first, axis, f"a {name} along its split dimension")
        kept = [d for d in range(eqn.invars[0].aval.ndim) if d not in reduced]
        return [first.moved([kept.index(d) for d in first.dims], raw=False)]
    if name in _SCANS_ALONG:
        if eqn.params["axis"] in first.dims:
            _refuse(eqn, first, axis, f"a {name} along its split dimension")
        return [first.moved(first.dims, raw=False)]
    if name in _VIEWS:
        return [t for t in inputs[: len(eqn.outvars)]]
    if name == "transpose":
        perm = list(eqn.params["permutation"])
        return [first.moved([perm.index(d) for d in first.dims])]
    if name == "broadcast_in_dim":
        to = eqn.params["broadcast_dimensions"]
        return [first.moved([to[d] for d in first.dims])]
    if name == "squeeze":
        gone = set(eqn.params["dimensions"])
        kept = [d for d in range(eqn.invars[0].aval.ndim) if d not in gone]
        return [first.moved([kept.index(d) for d in first.dims if d in kept])]
    if name == "reshape":
        shape_in, shape_out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        return [first.moved([_reshaped(d, shape_in, shape_out) for d in first.dims])]
    if name in ("slice", "dynamic_slice", "rev", "pad", "dynamic_update_slice", "sort"):
        return [first.moved(first.dims)] + [None] * (len(eqn.outvars) - 1)
    if name == "gather":
        return [_gathered(eqn, inputs, axis)]
    if name == "concatenate":
        return [_union(inputs, out_ndim[0])]
    if name == "select_n":  # the predicate decides which, the cases carry the trail
        return [_union(inputs[1:], out_ndim[0])]
    if name == "scan":
        return _scan(eqn, inputs, axis)
    if name == "while":
        return _while(eqn, inputs, axis)
    if name == "cond":
        branches = eqn.params["branches"]
        outs = [_walk(b.jaxpr, inputs[1:], axis) for b in branches]
        return [_union(list(column), n) for column, n in zip(zip(*outs), out_ndim)]
    inner = _called(eqn)
    if inner is not None:
        return _walk(inner, inputs, axis)
    if len(eqn.outvars) == 1 and _elementwise(eqn):
        # Arithmetic of the parameter alone (a scale, a negation) is still the parameter;
        # with another array it is a new value that carries the split.
        arrays = sum(getattr(v.aval, "shape", ()) != () for v in eqn.invars)
        joined = _union(inputs, out_ndim[0])
        return [joined if joined is None or arrays == 1 else joined.moved(joined.dims, False)]
    return [None] * len(eqn.outvars)  # an operation this reader does not follow


def _product(eqn: core.JaxprEqn, inputs: list[_Trail | None], axis: str) -> _Trail | None:
    """A matrix product or convolution: refused on the parameter itself, or contracting its
    split dimension; otherwise the trail moves to the output's dimensions."""
    for trail in inputs:
        if trail is not None and trail.raw:
            _refuse(eqn, trail, axis, f"a plain {eqn.primitive.name}")
    if eqn.primitive.name != "dot_general":
        return None
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    ndims = [v.aval.ndim for v in eqn.invars[:2]]
    free = [
        [d for d in range(n) if d not in c and d not in b]
        for n, c, b in ((ndims[0], contract_l, batch_l), (ndims[1], contract_r, batch_r))
    ]
    out: list[int] = []
    for side, trail in enumerate(inputs[:2]):
        if trail is None:
            continue
        contract, batch = ((contract_l, batch_l), (contract_r, batch_r))[side]
        if set(contract) & trail.dims:
            _refuse(eqn, trail, axis, "a product contracting its split dimension")
        for d in trail.dims:
            if d in batch:
                out.append(list(batch).index(d))
            else:
                offset = len(batch) + (len(free[0]) if side else 0)
                out.append(offset + free[side].index(d))
    found = next(t for t in inputs[:2] if t is not None)
    return found.moved(out, raw=False)


def _gathered(eqn: core.JaxprEqn, inputs: list[_Trail | None], axis: str) -> _Trail | None:
    """A lookup (``jnp.take``, indexing): refused along the split dimension of the
    parameter itself; otherwise the trail follows the dimensions taken whole."""
    trail = inputs[0]
    if trail is None:
        return None
    numbers = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    sizes = eqn.params["slice_sizes"]
    collapsed = set(numbers.collapsed_slice_dims) | set(numbers.operand_batching_dims)
    for d in trail.dims:
        if d in collapsed or sizes[d] != shape[d]:
            if trail.raw:
                _refuse(eqn, trail, axis, "a lookup along its split dimension")
            return None
    kept = [d for d in range(len(shape)) if d not in collapsed]
    return trail.moved([numbers.offset_dims[kept.index(d)] for d in trail.dims])


def _scan(eqn: core.JaxprEqn, inputs: list[_Trail | None], axis: str) -> list[_Trail | None]:
    """A scan's body read with its consts, carries and per-step slices of ``xs`` (stacked
    layers lose their leading dimension), until the carries' trails settle."""
    consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
    body = eqn.params["jaxpr"].jaxpr
    xs = [
        None if t is None else t.moved([d - 1 for d in t.dims]) for t in inputs[consts + carries :]
    ]
    carry = list(inputs[consts : consts + carries])
    for _ in range(3):
        outs = _walk(body, [*inputs[:consts], *carry, *xs], axis)
        merged = [_union([a, b], None) for a, b in zip(carry, outs[:carries])]
        if merged == carry:
            break
        carry = merged
    ys = [None if t is None else t.moved([d + 1 for d in t.dims]) for t in outs[carries:]]
    return [*carry, *ys]


def _while(eqn: core.JaxprEqn, inputs: list[_Trail | None], axis: str) -> list[_Trail | None]:
    """A while loop's body read with its consts and carries until the carries settle."""
    cond_consts, body_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    consts = inputs[cond_consts : cond_consts + body_consts]
    carry = list(inputs[cond_consts + body_consts :])
    for _ in range(3):
        outs = _walk(eqn.params["body_jaxpr"].jaxpr, [*consts, *carry], axis)
        merged = [_union([a, b], None) for a, b in zip(carry, outs)]
        if merged == carry:
            break
        carry = merged
    return carry


def _called(eqn: core.JaxprEqn) -> core.Jaxpr | None:
    """The program a call-like operation (jit, remat, custom derivatives) runs on exactly
    its inputs, or None."""
    for value in eqn.params.values():
        inner = value.jaxpr if isinstance(value, core.ClosedJaxpr) else value
        if (
            isinstance(inner, core.Jaxpr)
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def _elementwise(eqn: core.JaxprEqn) -> bool:
    """Whether every array input has the output's shape, or 1 along the dimensions it is
    broadcast over (scalars aside): arithmetic that keeps each element where it is."""
    if list(core.jaxprs_in_params(eqn.params)):
        return False
    shape = eqn.outvars[0].aval.shape
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    return all(
        s == () or (len(s) == len(shape) and all(a in (b, 1) for a, b in zip(s, shape)))
        for s in shapes
    )


def _union(trails: list[_Trail | None], ndim: int | None) -> _Trail | None:
    """One trail for a value made from several: the first parameter's name, every split
    dimension, the parameter itself only if every input on a trail was."""
    found = [t for t in trails if t is not None]
    if not found:
        return None
    dims = frozenset().union(*(t.dims for t in found))
    if ndim is not None:
        dims = frozenset(d for d in dims if d < ndim)
    raw = all(t.raw for t in found) and len(found) == 1
    return _Trail(found[0].path, dims, raw) if dims else None


def _reshaped(dim: int, shape_in: tuple, shape_out: tuple) -> int | None:
    """The output dimension of a reshape that holds input dimension ``dim``'s outermost
    index (where a split over the axis falls), or None."""
    start = math.prod(shape_in[:dim])
    if shape_in[dim] == 1:
        return None
    for out, size in enumerate(shape_out):
        before = math.prod(shape_out[:out])
        if before <= start < before * size and size > 1:
            return out
    return None


# --------------------------------------------------------------------------- the message

_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (jax, flax) if m.__file__ is not None
)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(eqn: core.JaxprEqn) -> str:
    """``file:line (function)`` of the innermost frame outside jax and jaxdist, and of the
    caller outside every library where that is another frame."""
    frames = list(eqn.source_info.traceback.frames) if eqn.source_info.traceback else []
    outside_jax = [
        f for f in frames if not f.file_name.startswith((os.path.dirname(jax.__file__), _HERE))
    ]
    if not outside_jax:
        return "an unknown place"
    first = outside_jax[0]
    text = f"{os.path.basename(first.file_name)}:{first.line_num} ({first.function_name})"
    mine = [f for f in outside_jax if not f.file_name.startswith(_LIBRARIES)]
    if mine and mine[0] is not first:
        caller = mine[0]
        text += f", called from {os.path.basename(caller.file_name)}:{caller.line_num}"
    return text


def _refuse(eqn: core.JaxprEqn, trail: _Trail, axis: str, what: str) -> None:
    raise SplitProductError(
        f"{trail.path} is split over {axis!r}, but {what} at {_where(eqn)} takes "
        f"it as if whole, with no sum over {axis!r}: multiply it with "
        f"jaxdist.comm.tensor_parallel.column_product or row_product, or keep it whole "
        f"(no rule mapping its dimensions to {axis})"
    )
