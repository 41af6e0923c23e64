"""How FSDP's paced segments are tied into the program: the handovers that let a layer's
gather start only once the layer before it runs (forward) or the layer after it has begun its
backward, the dtype each parameter travels in, and which of a layer's saved values backward
recomputes from the parameters it gathers again.

Shared by the segments of an unrolled loss (:mod:`jaxdist.training.fsdp_pacing`) and the
layers of a scanned one (:mod:`jaxdist.training.fsdp_scan`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from jaxdist.comm.scopes import PARAMETER_SCOPE

__all__: list[str] = []  # building blocks of the package's own modules


def is_var(v: Any) -> bool:
    return isinstance(v, jex.Var)


def gather_dtypes(params: Sequence[Any], eqns: Sequence[Any]) -> list[Any]:
    """Per parameter (a jaxpr var of ``params``, read by ``eqns``), the dtype its gather
    travels in: the narrower float dtype that every read of it casts it to first (a bfloat16
    layer's float32 kernel, also inside a recomputed block or a nested jit), else its own.
    The cast commutes with the gather, so the layer sees the very same values for half the
    bytes."""
    dtypes = []
    for param in params:
        own = jnp.dtype(param.aval.dtype)
        targets = _cast_targets(param, eqns, (), lambda j: None)
        narrow = targets.pop() if targets and len(targets) == 1 else own
        floats = jnp.issubdtype(own, jnp.floating) and jnp.issubdtype(narrow, jnp.floating)
        dtypes.append(narrow if floats and narrow.itemsize < own.itemsize else own)
    return dtypes


# Calls whose inner jaxpr takes the call's operands and gives its results in order: a read of a
# value by one of them is whatever its inner jaxpr does with it.
_CALLS = ("remat2", "checkpoint", "jit", "pjit", "closed_call", "core_call")


def _cast_targets(
    var: Any,
    eqns: Sequence[Any],
    outvars: Sequence[Any],
    on_return: Callable[[int], set | None],
) -> set | None:
    """The dtypes the reads of ``var`` convert it to, or None where a read is no cast. A value
    a call returns as it is (a recomputed flax NNX block gives back its parameters) is read
    where the call's result is: ``on_return(j)`` for ``outvars[j]``."""
    targets: set = set()
    for j, out in enumerate(outvars):
        if is_var(out) and out == var:
            found = on_return(j)
            if found is None:
                return None
            targets |= found
    for eqn in eqns:
        positions = [k for k, v in enumerate(eqn.invars) if is_var(v) and v == var]
        if not positions:
            continue
        if eqn.primitive.name == "convert_element_type":
            targets.add(jnp.dtype(eqn.params["new_dtype"]))
            continue
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's, or the Jaxpr itself
        if inner is None or len(inner.invars) != len(eqn.invars):
            return None

        def returned(j: int, eqn: Any = eqn) -> set | None:
            return _cast_targets(eqn.outvars[j], eqns, outvars, on_return)

        for k in positions:
            found = _cast_targets(inner.invars[k], inner.eqns, inner.outvars, returned)
            if found is None:
                return None
            targets |= found
    return targets


def floats(values: Sequence[Any]) -> list[jax.Array]:
    return [x for x in values if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


def handover_zero(values: Sequence[Any]) -> jax.Array:
    """A float32 zero computed from one element of every floating-point value of ``values``:
    it exists once they all do, which marks when a segment's inputs (forward) or its outputs'
    cotangents (backward) are there. Computed, not merely tied by an optimization barrier,
    since compilers drop barriers before they schedule: ``x * 0`` is not folded for floats
    (``inf * 0`` is NaN), and a NaN or an infinity becomes 0."""
    zero = jnp.zeros((), jnp.float32)
    for x in floats(values):
        if x.size:
            element = x.reshape(-1)[0].astype(jnp.float32) * 0.0
            zero = zero + jnp.where(jnp.isfinite(element), element, 0.0)
    return zero


def handover_vector(inputs: Sequence[Any], handover: jax.Array | None, prefetch: int) -> jax.Array:
    """Forward's handover, ``prefetch + 1`` entries: a zero once this segment's inputs are
    there, then the zeros of the ``prefetch - 1`` segments before it (shifted along from the
    handover it was given), then a 0 that backward's cotangent fills. Backward hands back, in
    its place, a zero once this segment's backward has begun and the next one's
    reduce-scatter is done, the same for the ``prefetch - 1`` segments after it, and last a
    zero once this one's reduce-scatter is done."""
    earlier = (
        jnp.zeros((prefetch - 1,), jnp.float32) if handover is None else handover[: prefetch - 1]
    )
    return jnp.concatenate([handover_zero(inputs)[None], earlier, jnp.zeros((1,), jnp.float32)])


def gate(handover: jax.Array | None, prefetch: int) -> jax.Array | None:
    """What a segment's gather waits for: in forward, the inputs of the segment ``prefetch``
    before it; in backward, the backward of the segment ``prefetch`` after it."""
    return None if handover is None else handover[prefetch - 1]


def after_handover(shards: Sequence[jax.Array], handover: jax.Array | None) -> list[jax.Array]:
    """``shards`` made to depend on ``handover`` (a zero): its first element plus it, so that
    the gather reading them cannot start before the handover exists. Adding zero changes no
    value (a -0.0 turns +0.0)."""
    shards = list(shards)
    if handover is None or not shards:
        return shards
    first = shards[0]
    flat = first.reshape(-1)
    flat = flat.at[0].add(handover.astype(first.dtype))
    shards[0] = flat.reshape(first.shape)
    return shards


def w_only_residuals(f: Callable, inputs: Sequence[Any], whole: Sequence[Any]) -> list[bool]:
    """Which leaves of ``jax.vjp(f, inputs, whole)``'s residuals depend on the parameters
    alone (not on the inputs): those backward recomputes from the gathered parameters."""

    def residuals(ins, ws):
        return jax.tree.leaves(jax.vjp(f, ins, ws)[1])

    closed = jax.make_jaxpr(residuals)(list(inputs), list(whole))
    jaxpr = closed.jaxpr
    from_inputs = set(jaxpr.invars[: len(inputs)])
    for eqn in jaxpr.eqns:  # a call's outputs follow all its operands: the safe side
        if any(is_var(v) and v in from_inputs for v in eqn.invars):
            from_inputs.update(eqn.outvars)
    return [not (is_var(v) and v in from_inputs) for v in jaxpr.outvars]


def placeholder(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of ``aval``'s shape and dtype (a PRNG key array too) whose values go unread."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return jnp.broadcast_to(jax.random.key(0), aval.shape)
    return jnp.zeros(aval.shape, aval.dtype)


def gather_whole(
    shards: Sequence[jax.Array],
    tie: jax.Array | None,
    again: bool,
    travel: Sequence[Any],
    dims: Sequence[int],
    gather: Callable,
) -> list[Any]:
    """A layer's whole parameters from this device's ``shards`` (split along ``dims``), one
    ``gather`` per dtype they travel in (``travel``), each cast back to the parameter's own
    dtype (exact: a cast up from the narrower dtype); not before ``tie`` exists."""
    whole: list[Any] = [None] * len(shards)
    with jax.named_scope(PARAMETER_SCOPE):
        for dtype in dict.fromkeys(travel):
            group = [i for i, d in enumerate(travel) if d == dtype]
            cast = after_handover([shards[i].astype(dtype) for i in group], tie)
            for i, w in zip(group, gather(cast, [dims[i] for i in group], again)):
                whole[i] = w.astype(shards[i].dtype)
    return whole


def handed_back(
    handover: jax.Array | None,
    handover_ct: jax.Array,
    output_cts: Sequence[Any],
    shard_cts: Sequence[Any],
    prefetch: int,
) -> jax.Array | None:
    """What a layer's backward hands back in place of its forward's ``handover``: the layer
    before may gather again once this one's backward has begun and the next one's
    reduce-scatter is done (it ran beside this one's backward); so may the layer
    ``prefetch`` before, once the layer ``prefetch - 1`` after this one got as far. This
    one's reduce-scatter is handed on, to gate the gather after that."""
    if handover is None:
        return None
    begun = handover_zero(list(output_cts)) + handover_ct[prefetch]
    later = handover_ct[: prefetch - 1]
    return jnp.concatenate([begun[None], later, handover_zero(shard_cts)[None]])
