"""FSDP's collectives placed in the program: each parameter gathered just before the layer
that reads it, one layer ahead, in forward and again in backward, and its gradient
reduce-scattered as that layer's backward ends.

Gathering every unit at the top of the loss leaves the order to the compiler, which starts
every gather as early as it may -- at the top of the step -- and so holds the whole model
gathered (and, in backward, every gathered copy and every whole gradient at once): FSDP's
memory is gone. This module fixes the order in the program itself:

1. The loss is traced once on whole parameters (``jax.make_jaxpr``) and cut into
   *segments*: a segment starts at each matrix product or convolution that reads
   parameters no earlier segment read, itself or through casts and relayouts (a layer's
   kernel, or the bfloat16 copy a mixed-precision layer makes of it: the segment then
   starts at that cast; its bias or a norm's scale joins the segment open when it is first
   read), and a parameter read again later keeps every equation between its reads in one
   segment.
2. Each segment runs as one ``jax.custom_vjp`` function of its inputs and its parameters'
   blocks. Forward: it gathers its blocks (one collective of the family for all of them, in
   the narrower dtype the segment casts them to before any use, if it does: a bfloat16
   layer's float32 kernel travels as bfloat16)
   once a scalar the segment *before* it hands over at its own start exists -- so segment
   ``k + 1``'s gather runs beside segment ``k``'s compute and no earlier -- and keeps for
   backward what ``jax.vjp`` keeps, less what is computed from the gathered parameters alone
   (the parameters themselves, their casts and transposes). Backward: it gathers its blocks
   again once the cotangent of that scalar exists, which segment ``k + 1``'s backward hands
   back as it begins (and once segment ``k + 2``'s reduce-scatter is done) -- so the gather
   runs beside the later segment's backward -- recomputes what it did not keep from the
   parameters, applies the saved ``vjp`` and reduce-scatters the parameters' gradient into
   the blocks. Backward's gather sends each buffer back to front, so the compiler cannot
   merge it with forward's (and keep forward's gathered copy alive until backward).
3. The ties are data, not ``lax.optimization_barrier``: compilers drop barriers before they
   schedule. A handover is a zero computed from one element of every value it waits for
   (``x * 0``, which compilers do not fold for floats), added to one element of the blocks.

The arithmetic is the loss's own, equation by equation; only where the compiler may place
the collectives is narrowed: no gather starts more than one segment ahead of its use, or
``prefetch`` segments where asked (the handover then carries the marks of that many
segments along, and a gather waits for the mark of the segment ``prefetch`` before it in
forward, after it in backward).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from jaxdist.comm.scopes import GRADIENT_SCOPE, PARAMETER_SCOPE
from jaxdist.training.wait_free import has_matmul

__all__: list[str] = []  # building blocks of the package's own modules


@dataclass
class _Segment:
    eqns: list  # the loss's equations, in order
    inputs: list  # vars read, defined outside the segment (not sharded parameters)
    outputs: list  # vars defined here and read later (or returned)
    leaves: list[int]  # the sharded parameter leaves it gathers
    params: list  # their invars, in the order of ``leaves``


# Primitives that only cast or lay out one value anew (``jnp.expand_dims`` traces to
# ``broadcast_in_dim``).
_RELAYOUTS = {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
              "copy"}  # fmt: skip


def _is_var(v: Any) -> bool:
    return isinstance(v, jex.Var)


def segments_of(jaxpr: Any, param_vars: Mapping[Any, int]) -> list[_Segment]:
    """The loss's equations cut into segments (see the module docstring); ``param_vars`` maps
    each sharded parameter's invar to its leaf index."""
    eqns = list(jaxpr.eqns)
    # A value cast or reshaped from one parameter alone (a bfloat16 layer's copy of its
    # float32 kernel) is read as that parameter: the product reading it opens the layer.
    origin: dict[Any, Any] = {v: v for v in param_vars}
    first: dict[Any, int] = {}  # each parameter's first read (its cast, if it is cast)
    last: dict[Any, int] = {}  # its last read, itself or a value cast from it
    first_use: dict[Any, int] = {}  # its first read by anything but such a cast
    for i, eqn in enumerate(eqns):
        sources = {origin[v] for v in eqn.invars if _is_var(v) and v in origin}
        for v in eqn.invars:
            if _is_var(v) and v in param_vars:
                first.setdefault(v, i)
        for p in sources:
            last[p] = i
        if eqn.primitive.name in _RELAYOUTS and len(sources) == 1 and all(
            not _is_var(v) or v in origin for v in eqn.invars
        ):  # fmt: skip
            origin.update(dict.fromkeys(eqn.outvars, next(iter(sources))))
        else:
            for p in sources:
                first_use.setdefault(p, i)
    if any(v in param_vars for v in jaxpr.outvars if _is_var(v)):
        raise ValueError("fsdp: the loss returns a parameter itself; it cannot be paced")
    # Boundaries at products that read new parameters (a layer's kernel), once the open
    # segment did a product -- placed at the first cast of those parameters if it comes after
    # that product; other new parameters (a bias, a norm's scale) join the open segment.
    starts, matmul_since, last_matmul = [0], False, -1
    for i, eqn in enumerate(eqns):
        matmul = has_matmul(eqn)
        opened = [origin[v] for v in eqn.invars
                  if _is_var(v) and v in origin and first_use.get(origin[v]) == i]  # fmt: skip
        if opened and matmul and matmul_since:
            start = max(min(first[p] for p in opened), last_matmul + 1)
            if start > starts[-1]:
                starts.append(start)
                matmul_since = False
        matmul_since = matmul_since or matmul
        last_matmul = i if matmul else last_matmul
    # A parameter read in several segments keeps them one.
    for v in first:
        lo = max(s for s in starts if s <= first[v])
        starts = [s for s in starts if not lo < s <= last[v]]
    bounds = [*starts, len(eqns)]
    last_read: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _is_var(v):
                last_read[v] = i
    for v in jaxpr.outvars:
        if _is_var(v):
            last_read[v] = len(eqns)
    segments = []
    for a, b in itertools.pairwise(bounds):
        part = eqns[a:b]
        defined = {v for eqn in part for v in eqn.outvars}
        reads = list(dict.fromkeys(v for eqn in part for v in eqn.invars if _is_var(v)))
        params = [v for v in reads if v in param_vars]
        inputs = [v for v in reads if v not in defined and v not in param_vars]
        outputs = [v for eqn in part for v in eqn.outvars if last_read.get(v, -1) >= b]
        segments.append(_Segment(part, inputs, outputs, [param_vars[v] for v in params], params))
    return segments


def gather_dtypes(segment: _Segment) -> list[Any]:
    """Per parameter of ``segment``, the dtype its gather travels in: the narrower float
    dtype that every read of it casts it to first (a bfloat16 layer's float32 kernel), else
    its own. The cast commutes with the gather, so the segment sees the very same values for
    half the bytes."""
    dtypes = []
    for param in segment.params:
        own = jnp.dtype(param.aval.dtype)
        reads = [eqn for eqn in segment.eqns if any(_is_var(v) and v == param for v in eqn.invars)]
        # What its reads are: narrowed only if every one is the same cast.
        kinds = {(eqn.primitive.name, eqn.params.get("new_dtype")) for eqn in reads}
        name, target = next(iter(kinds))
        narrow = jnp.dtype(target) if len(kinds) == 1 and name == "convert_element_type" else own
        floats = jnp.issubdtype(own, jnp.floating) and jnp.issubdtype(narrow, jnp.floating)
        dtypes.append(narrow if floats and narrow.itemsize < own.itemsize else own)
    return dtypes


def _evaluate(segment: _Segment, inputs: Sequence[Any], params: Sequence[Any]) -> list[Any]:
    """The segment's outputs from its inputs and its whole parameters."""
    names = jex.DebugInfo("fsdp segment", "jaxdist.training.fsdp_pacing",
                          tuple(map(str, [*segment.inputs, *segment.params])),
                          tuple(map(str, segment.outputs)))  # fmt: skip
    effects = frozenset().union(*(eqn.effects for eqn in segment.eqns))
    jaxpr = jex.Jaxpr([], [*segment.inputs, *segment.params], segment.outputs, segment.eqns,
                      effects, names)  # fmt: skip
    return jax.core.eval_jaxpr(jaxpr, [], *inputs, *params)


def _floats(values: Sequence[Any]) -> list[jax.Array]:
    return [x for x in values if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


def _handover(values: Sequence[Any]) -> jax.Array:
    """A float32 zero computed from one element of every floating-point value of ``values``:
    it exists once they all do, which marks when a segment's inputs (forward) or its outputs'
    cotangents (backward) are there. Computed, not merely tied by an optimization barrier,
    since compilers drop barriers before they schedule: ``x * 0`` is not folded for floats
    (``inf * 0`` is NaN), and a NaN or an infinity becomes 0."""
    zero = jnp.zeros((), jnp.float32)
    for x in _floats(values):
        if x.size:
            element = x.reshape(-1)[0].astype(jnp.float32) * 0.0
            zero = zero + jnp.where(jnp.isfinite(element), element, 0.0)
    return zero


def _handover_vector(inputs: Sequence[Any], handover: jax.Array | None, prefetch: int) -> jax.Array:
    """Forward's handover, ``prefetch + 1`` entries: a zero once this segment's inputs are
    there, then the zeros of the ``prefetch - 1`` segments before it (shifted along from the
    handover it was given), then a 0 that backward's cotangent fills. Backward hands back, in
    its place, a zero once this segment's backward has begun and the next one's
    reduce-scatter is done, the same for the ``prefetch - 1`` segments after it, and last a
    zero once this one's reduce-scatter is done."""
    earlier = (jnp.zeros((prefetch - 1,), jnp.float32) if handover is None
               else handover[: prefetch - 1])  # fmt: skip
    return jnp.concatenate([_handover(inputs)[None], earlier, jnp.zeros((1,), jnp.float32)])


def _gate(handover: jax.Array | None, prefetch: int) -> jax.Array | None:
    """What a segment's gather waits for: in forward, the inputs of the segment ``prefetch``
    before it; in backward, the backward of the segment ``prefetch`` after it."""
    return None if handover is None else handover[prefetch - 1]


def _after(shards: Sequence[jax.Array], handover: jax.Array | None) -> list[jax.Array]:
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


def _w_only_residuals(f: Callable, inputs: Sequence[Any], whole: Sequence[Any]) -> list[bool]:
    """Which leaves of ``jax.vjp(f, inputs, whole)``'s residuals depend on the parameters
    alone (not on the inputs): those backward recomputes from the gathered parameters."""

    def residuals(ins, ws):
        return jax.tree.leaves(jax.vjp(f, ins, ws)[1])

    closed = jax.make_jaxpr(residuals)(list(inputs), list(whole))
    jaxpr = closed.jaxpr
    from_inputs = set(jaxpr.invars[: len(inputs)])
    for eqn in jaxpr.eqns:  # a call's outputs follow all its operands: the safe side
        if any(_is_var(v) and v in from_inputs for v in eqn.invars):
            from_inputs.update(eqn.outvars)
    return [not (_is_var(v) and v in from_inputs) for v in jaxpr.outvars]


def _placeholder(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """An array of ``aval``'s shape and dtype (a PRNG key array too) whose values go unread."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return jnp.broadcast_to(jax.random.key(0), aval.shape)
    return jnp.zeros(aval.shape, aval.dtype)


def paced_loss(loss_fn: Callable, layout: Any, gather: Callable, scatter: Callable,
               prefetch: int = 1, on_segments: Callable[[int], None] | None = None,
               ) -> Callable:  # fmt: skip
    """``loss_fn`` on a device's parameter blocks with every gather and reduce-scatter placed
    as the module docstring says. ``gather(blocks, dims, again) -> whole`` and
    ``scatter(whole, dims) -> blocks`` are the unit collectives
    (:mod:`jaxdist.training.sharding`); ``again`` marks backward's gather, which must not be
    merged with forward's. ``prefetch``: how many segments ahead of its use a gather may
    start (1: beside the segment before it). ``on_segments`` is told, at each trace, how
    many segments the loss was cut into."""

    def sharded_loss(params, model_state, batch, rng):
        blocks, treedef = jax.tree.flatten(params)
        split = [i for i, d in enumerate(layout.dims) if d is not None]
        kept_whole = [i for i, d in enumerate(layout.dims) if d is None]
        whole_shapes = [jax.ShapeDtypeStruct(layout.shapes[i], blocks[i].dtype) for i in split]
        others, others_def = jax.tree.flatten((model_state, batch, rng))
        free = [blocks[i] for i in kept_whole]

        def traced(whole, free_leaves, other_leaves):
            leaves = list(blocks)
            for i, w in zip([*split, *kept_whole], [*whole, *free_leaves], strict=True):
                leaves[i] = w
            ms, b, r = jax.tree.unflatten(others_def, other_leaves)
            return loss_fn(jax.tree.unflatten(treedef, leaves), ms, b, r)

        closed, out_shapes = jax.make_jaxpr(traced, return_shape=True)(whole_shapes, free, others)
        jaxpr = closed.jaxpr
        whole_vars = jaxpr.invars[: len(split)]
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars[len(split) :], [*free, *others]))
        segments = segments_of(jaxpr, {v: split[k] for k, v in enumerate(whole_vars)})
        if on_segments is not None:
            on_segments(len(segments))
        handover = None  # what the previous segment handed over (see _handover_vector)
        for segment in segments:
            step = _segment_step(segment, layout, gather, scatter, prefetch)
            shards = [blocks[i] for i in segment.leaves]
            values = [env[v] for v in segment.inputs]
            outputs, handover = step(values, shards, handover)
            env.update(zip(segment.outputs, outputs))
        read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
        return jax.tree.unflatten(jax.tree.structure(out_shapes), [read(v) for v in jaxpr.outvars])

    return sharded_loss


def _segment_step(segment: _Segment, layout: Any, gather: Callable, scatter: Callable,
                  prefetch: int):  # fmt: skip
    """``(inputs, blocks, handover) -> (outputs, handover)``: one segment as a custom_vjp."""
    dims = [layout.dims[i] for i in segment.leaves]
    travel = gather_dtypes(segment)
    f = lambda ins, ws: _evaluate(segment, ins, ws)  # noqa: E731
    saved: dict[str, Any] = {}

    def gathered(shards, tie, again=False):
        """The whole parameters, one gather per dtype they travel in, each cast back to the
        parameter's own dtype (exact: a cast up from the narrower dtype)."""
        whole: list[Any] = [None] * len(shards)
        with jax.named_scope(PARAMETER_SCOPE):
            for dtype in dict.fromkeys(travel):
                group = [i for i, d in enumerate(travel) if d == dtype]
                cast = [shards[i].astype(dtype) for i in group]
                for i, w in zip(group, gather(_after(cast, tie), [dims[i] for i in group], again)):
                    whole[i] = w.astype(shards[i].dtype)
        return whole

    @jax.custom_vjp
    def step(inputs, shards, handover):
        whole = gathered(shards, _gate(handover, prefetch))
        return f(inputs, whole), _handover_vector(inputs, handover, prefetch)

    def forward(inputs, shards, handover):
        whole = gathered(shards, _gate(handover, prefetch))
        outputs, vjp_fn = jax.vjp(f, list(inputs), list(whole))
        leaves, saved["treedef"] = jax.tree.flatten(vjp_fn)
        recomputed = _w_only_residuals(f, inputs, whole) if shards else [False] * len(leaves)
        saved["recomputed"] = recomputed
        kept = [leaf for leaf, r in zip(leaves, recomputed, strict=True) if not r]
        saved["inputs"] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        handed = _handover_vector(inputs, handover, prefetch)
        return (outputs, handed), (kept, list(shards), handover)

    def backward(residuals, cotangents):
        kept, shards, handover = residuals
        output_cts, handover_ct = cotangents
        whole = gathered(shards, _gate(handover_ct, prefetch), again=True)
        if any(saved["recomputed"]):
            # What depends on the parameters alone does not read the inputs: stand-ins do.
            stand_ins = [_placeholder(x) for x in saved["inputs"]]
            again = jax.tree.leaves(jax.vjp(f, stand_ins, list(whole))[1])
        kept_iter = iter(kept)
        leaves = [again[k] if r else next(kept_iter) for k, r in enumerate(saved["recomputed"])]
        vjp_fn = jax.tree.unflatten(saved["treedef"], leaves)
        input_cts, whole_cts = vjp_fn(list(output_cts))
        with jax.named_scope(GRADIENT_SCOPE):
            shard_cts = scatter(whole_cts, dims) if shards else []
        # The segment before may gather again once this one's backward has begun and the
        # next one's reduce-scatter is done (it ran beside this one's backward); so may the
        # segment ``prefetch`` before, once the segment ``prefetch - 1`` after this one got
        # as far. This one's reduce-scatter is handed on, to gate the gather after that.
        if handover is None:
            return input_cts, shard_cts, None
        begun = _handover(list(output_cts)) + handover_ct[prefetch]
        later = handover_ct[: prefetch - 1]
        return (
            input_cts,
            shard_cts,
            jnp.concatenate([begun[None], later, _handover(shard_cts)[None]]),
        )

    step.defvjp(forward, backward)
    return step
