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
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jex

from jaxdist.comm.scopes import GRADIENT_SCOPE
from jaxdist.training.fsdp_scan import scanned_step, scans_stacked_layers
from jaxdist.training.fsdp_ties import (
    gate,
    gather_dtypes,
    gather_whole,
    handed_back,
    handover_vector,
    is_var,
    placeholder,
    w_only_residuals,
)
from jaxdist.training.wait_free import has_matmul

__all__: list[str] = []  # building blocks of the package's own modules


@dataclass
class _Segment:
    eqns: list  # the loss's equations, in order
    inputs: list  # vars read, defined outside the segment (not sharded parameters)
    outputs: list  # vars defined here and read later (or returned)
    leaves: list[int]  # the sharded parameter leaves it gathers
    params: list  # their invars, in the order of ``leaves``
    scan: bool = False  # one scan over stacked layers, gathered layer by layer (fsdp_scan)


# Primitives that only cast or lay out one value anew (``jnp.expand_dims`` traces to
# ``broadcast_in_dim``).
_RELAYOUTS = {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze", "copy"}


def segments_of(
    jaxpr: Any, param_vars: Mapping[Any, int], stacked: Container[int] = ()
) -> list[_Segment]:
    """The loss's equations cut into segments (see the module docstring); ``param_vars`` maps
    each sharded parameter's invar to its leaf index, ``stacked`` names the leaves split
    below a leading layer axis: a scan over them is a segment of its own, gathered layer by
    layer inside the scan (:mod:`jaxdist.training.fsdp_scan`)."""
    eqns = list(jaxpr.eqns)
    # A value cast or reshaped from one parameter alone (a bfloat16 layer's copy of its
    # float32 kernel) is read as that parameter: the product reading it opens the layer.
    origin: dict[Any, Any] = {v: v for v in param_vars}
    first: dict[Any, int] = {}  # each parameter's first read (its cast, if it is cast)
    last: dict[Any, int] = {}  # its last read, itself or a value cast from it
    first_use: dict[Any, int] = {}  # its first read by anything but such a cast
    for i, eqn in enumerate(eqns):
        sources = {origin[v] for v in eqn.invars if is_var(v) and v in origin}
        for v in eqn.invars:
            if is_var(v) and v in param_vars:
                first.setdefault(v, i)
        for p in sources:
            last[p] = i
        if (
            eqn.primitive.name in _RELAYOUTS
            and len(sources) == 1
            and all(not is_var(v) or v in origin for v in eqn.invars)
        ):
            origin.update(dict.fromkeys(eqn.outvars, next(iter(sources))))
        else:
            for p in sources:
                first_use.setdefault(p, i)
    if any(v in param_vars for v in jaxpr.outvars if is_var(v)):
        raise ValueError("fsdp: the loss returns a parameter itself; it cannot be paced")
    # Boundaries at products that read new parameters (a layer's kernel), once the open
    # segment did a product -- placed at the first cast of those parameters if it comes after
    # that product; other new parameters (a bias, a norm's scale) join the open segment.
    starts, matmul_since, last_matmul = [0], False, -1
    for i, eqn in enumerate(eqns):
        matmul = has_matmul(eqn)
        opened = [
            origin[v]
            for v in eqn.invars
            if is_var(v) and v in origin and first_use.get(origin[v]) == i
        ]
        if opened and matmul and matmul_since:
            start = max(min(first[p] for p in opened), last_matmul + 1)
            if start > starts[-1]:
                starts.append(start)
                matmul_since = False
        matmul_since = matmul_since or matmul
        last_matmul = i if matmul else last_matmul
    scans = [i for i, eqn in enumerate(eqns) if scans_stacked_layers(eqn, param_vars, stacked)]
    starts = sorted({*starts, *scans, *(i + 1 for i in scans if i + 1 < len(eqns))})
    # A parameter read in several segments keeps them one, but for a scan of stacked layers
    # between its reads (a tied embedding read by the head after the blocks): that scan
    # would then gather every layer at once, so each segment gathers the parameter itself,
    # and their gradients' shards add up.
    for v in first:
        if any(first[v] < i < last[v] for i in scans):
            continue
        lo = max(s for s in starts if s <= first[v])
        starts = [s for s in starts if not lo < s <= last[v]]
    bounds = [*starts, len(eqns)]
    last_read: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if is_var(v):
                last_read[v] = i
    for v in jaxpr.outvars:
        if is_var(v):
            last_read[v] = len(eqns)
    segments = []
    for a, b in itertools.pairwise(bounds):
        part = eqns[a:b]
        defined = {v for eqn in part for v in eqn.outvars}
        reads = list(dict.fromkeys(v for eqn in part for v in eqn.invars if is_var(v)))
        params = [v for v in reads if v in param_vars]
        inputs = [v for v in reads if v not in defined and v not in param_vars]
        outputs = [v for eqn in part for v in eqn.outvars if last_read.get(v, -1) >= b]
        scan = len(part) == 1 and a in scans
        segments.append(
            _Segment(part, inputs, outputs, [param_vars[v] for v in params], params, scan)
        )
    return segments


def _evaluate(segment: _Segment, inputs: Sequence[Any], params: Sequence[Any]) -> list[Any]:
    """The segment's outputs from its inputs and its whole parameters."""
    names = jex.DebugInfo(
        "fsdp segment",
        "jaxdist.training.fsdp_pacing",
        tuple(map(str, [*segment.inputs, *segment.params])),
        tuple(map(str, segment.outputs)),
    )
    effects = frozenset().union(*(eqn.effects for eqn in segment.eqns))
    jaxpr = jex.Jaxpr(
        [], [*segment.inputs, *segment.params], segment.outputs, segment.eqns, effects, names
    )
    return jax.core.eval_jaxpr(jaxpr, [], *inputs, *params)


def paced_loss(
    loss_fn: Callable,
    placement: Any,
    gather: Callable,
    scatter: Callable,
    prefetch: int = 1,
    on_segments: Callable[[int], None] | None = None,
    *,
    scatter_behind: bool = False,
) -> Callable:
    """``loss_fn`` on a device's parameter blocks with every gather and reduce-scatter placed
    as the module docstring says. ``gather(blocks, dims, again) -> whole`` and
    ``scatter(whole, dims) -> blocks`` are the unit collectives
    (:mod:`jaxdist.training.sharding`); ``again`` marks backward's gather, which must not be
    merged with forward's. ``prefetch``: how many segments ahead of its use a gather may
    start (1: beside the segment before it). ``on_segments`` is told, at each trace, how
    many segments the loss was cut into. ``scatter_behind``: a scanned segment reduce-scatters
    each layer's gradient during the backward of the layer before it
    (:func:`~jaxdist.training.fsdp_scan.scanned_step`)."""

    def sharded_loss(params, model_state, batch, rng):
        blocks, treedef = jax.tree.flatten(params)
        split = [i for i, d in enumerate(placement.dims) if d is not None]
        kept_whole = [i for i, d in enumerate(placement.dims) if d is None]
        whole_shapes = [jax.ShapeDtypeStruct(placement.shapes[i], blocks[i].dtype) for i in split]
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
        stacked = {i for i in split if placement.stacked[i]}
        segments = segments_of(jaxpr, {v: split[k] for k, v in enumerate(whole_vars)}, stacked)
        if on_segments is not None:
            on_segments(len(segments))
        handover = None  # what the previous segment handed over (see handover_vector)
        for segment in segments:
            if segment.scan:
                step = scanned_step(segment, placement, gather, scatter, prefetch, scatter_behind)
            else:
                step = _segment_step(segment, placement, gather, scatter, prefetch)
            shards = [blocks[i] for i in segment.leaves]
            values = [env[v] for v in segment.inputs]
            outputs, handover = step(values, shards, handover)
            env.update(zip(segment.outputs, outputs))
        read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
        return jax.tree.unflatten(jax.tree.structure(out_shapes), [read(v) for v in jaxpr.outvars])

    return sharded_loss


def _segment_step(
    segment: _Segment, placement: Any, gather: Callable, scatter: Callable, prefetch: int
):
    """``(inputs, blocks, handover) -> (outputs, handover)``: one segment as a custom_vjp."""
    dims = [placement.dims[i] for i in segment.leaves]
    travel = gather_dtypes(segment.params, segment.eqns)
    f = lambda ins, ws: _evaluate(segment, ins, ws)  # noqa: E731
    saved: dict[str, Any] = {}

    def gathered(shards, tie, again=False):
        return gather_whole(shards, tie, again, travel, dims, gather)

    @jax.custom_vjp
    def step(inputs, shards, handover):
        whole = gathered(shards, gate(handover, prefetch))
        return f(inputs, whole), handover_vector(inputs, handover, prefetch)

    def forward(inputs, shards, handover):
        whole = gathered(shards, gate(handover, prefetch))
        outputs, vjp_fn = jax.vjp(f, list(inputs), list(whole))
        leaves, saved["treedef"] = jax.tree.flatten(vjp_fn)
        recomputed = w_only_residuals(f, inputs, whole) if shards else [False] * len(leaves)
        saved["recomputed"] = recomputed
        kept = [leaf for leaf, r in zip(leaves, recomputed, strict=True) if not r]
        saved["inputs"] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        handed = handover_vector(inputs, handover, prefetch)
        return (outputs, handed), (kept, list(shards), handover)

    def backward(residuals, cotangents):
        kept, shards, handover = residuals
        output_cts, handover_ct = cotangents
        whole = gathered(shards, gate(handover_ct, prefetch), again=True)
        if any(saved["recomputed"]):
            # What depends on the parameters alone does not read the inputs: stand-ins do.
            stand_ins = [placeholder(x) for x in saved["inputs"]]
            again = jax.tree.leaves(jax.vjp(f, stand_ins, list(whole))[1])
        kept_iter = iter(kept)
        leaves = [again[k] if r else next(kept_iter) for k, r in enumerate(saved["recomputed"])]
        vjp_fn = jax.tree.unflatten(saved["treedef"], leaves)
        input_cts, whole_cts = vjp_fn(list(output_cts))
        with jax.named_scope(GRADIENT_SCOPE):
            shard_cts = scatter(whole_cts, dims) if shards else []
        return (
            input_cts,
            shard_cts,
            handed_back(handover, handover_ct, output_cts, shard_cts, prefetch),
        )

    step.defvjp(forward, backward)
    return step
