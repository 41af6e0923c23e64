"""FSDP for layers a loss scans over: each layer's parameters gathered inside the scan.

A deep model runs its blocks as one ``lax.scan`` over parameters stacked along a leading
layer axis (``nnx.scan``, linen's ``nn.scan``, MaxText's ``scan_layers``), so its program
holds one block whatever the depth. FSDP keeps such a parameter split along a dimension
*below* the layer axis (:class:`~jaxdist.training.sharding.Placement` with ``stacked``): each
device holds a slice of every layer. Paced as one segment, the scan would gather the whole
stack at once; instead the scan is run again here, as one ``jax.custom_vjp``:

* forward, a scan over the layers: layer ``i`` computes on the parameters gathered during
  layer ``i - 1`` while it gathers layer ``i + 1``'s (one layer ahead, two layers gathered
  at once), and keeps for backward what ``jax.vjp`` of the layer keeps, less what is
  computed from its parameters alone;
* backward, a scan over the layers in reverse: layer ``i`` gathers its parameters again
  (prefetched during layer ``i + 1``'s backward), recomputes what depends on them alone,
  applies the layer's ``vjp`` and reduce-scatters its gradient into this device's slice;
  with ``scatter_behind``, layer ``i + 1``'s gradient is reduce-scattered during layer
  ``i``'s backward instead (one layer behind, hidden behind its compute, one whole layer's
  gradient more in memory).

The model's own activation checkpointing (``nnx.remat`` in the scanned body) decides what a
layer keeps, as without FSDP. The first layer's gather waits for the handover of the
segment before the scan, and the segment after it sees the scan as one segment
(:mod:`jaxdist.training.fsdp_ties`). The prefetch wraps around: the last layer of each pass
gathers one layer more than it uses, one layer in ``L`` of the parameter traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.comm.scopes import GRADIENT_SCOPE
from jaxdist.training.fsdp_ties import (
    gate,
    gather_dtypes,
    gather_whole,
    handed_back,
    handover_vector,
    is_var,
    w_only_residuals,
)

__all__: list[str] = []  # building blocks of the package's own modules


def scans_stacked_layers(eqn: Any, param_vars: Mapping[Any, int], stacked: Container[int]) -> bool:
    """Whether ``eqn`` is a forward ``lax.scan`` whose sharded parameters are all stacked
    leaves (``stacked``: leaf indices split below their layer axis) scanned over, each
    read once: a scan this module can gather layer by layer."""
    if eqn.primitive.name != "scan" or eqn.params["reverse"]:
        return False
    first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
    read = [(k, v) for k, v in enumerate(eqn.invars) if is_var(v) and v in param_vars]
    if not read or len({v for _, v in read}) < len(read):
        return False
    return all(k >= first_xs and param_vars[v] in stacked for k, v in read)


def _float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_cotangent(aval: Any) -> Any:
    """The cotangent of a value that has none (an integer, a PRNG key): float0 zeros."""
    return np.zeros(aval.shape, jax.dtypes.float0)


def scanned_step(
    segment: Any,
    placement: Any,
    gather: Callable,
    scatter: Callable,
    prefetch: int,
    scatter_behind: bool = False,
) -> Callable:
    """``(inputs, blocks, handover) -> (outputs, handover)`` for a segment that is one scan
    over stacked layers (:func:`scans_stacked_layers`), as a custom_vjp (see the module
    docstring). ``blocks`` are this device's slices of the stacked parameters."""
    (eqn,) = segment.eqns
    body = eqn.params["jaxpr"]
    num_consts, num_carry, length = (eqn.params[k] for k in ("num_consts", "num_carry", "length"))
    first_xs = num_consts + num_carry
    param_at = {k: segment.params.index(v) for k, v in enumerate(eqn.invars) if v in segment.params}
    other_xs = [k for k in range(first_xs, len(eqn.invars)) if k not in param_at]
    needed = [eqn.outvars.index(v) for v in segment.outputs]  # each a carry or a ys
    needed_ys = [o - num_carry for o in needed if o >= num_carry]
    # Within one layer a stacked leaf's split dimension is one lower.
    dims = [placement.dims[i] - 1 for i in segment.leaves]
    body_params = [body.jaxpr.invars[k] for k in sorted(param_at, key=param_at.get)]
    travel = gather_dtypes(body_params, body.jaxpr.eqns)
    carry_avals = [v.aval for v in body.jaxpr.outvars[:num_carry]]
    ys_avals = [body.jaxpr.outvars[num_carry + y].aval for y in needed_ys]
    saved: dict[str, Any] = {}

    def value(inputs, k):
        v = eqn.invars[k]
        return v.val if not is_var(v) else inputs[segment.inputs.index(v)]

    def layer(ins, ws):
        """One layer: ``ins`` = carry + its slice of the other scanned values, ``ws`` = its
        whole parameters + the scan's constants; ``-> carry + the needed outputs``."""
        args: list[Any] = [None] * len(eqn.invars)
        carry, xs = ins[:num_carry], ins[num_carry:]
        params, consts = ws[: len(param_at)], ws[len(param_at) :]
        args[:num_consts] = consts
        args[num_consts:first_xs] = carry
        for k, x in zip(other_xs, xs):
            args[k] = x
        for k, j in param_at.items():
            args[k] = params[j]
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *args)
        return [*outs[:num_carry], *(outs[num_carry + y] for y in needed_ys)]

    def gathered(shards, i, tie, again=False):
        layer_shards = [lax.dynamic_index_in_dim(s, i, 0, keepdims=False) for s in shards]
        return gather_whole(layer_shards, tie, again, travel, dims, gather)

    def split(inputs):
        consts = [value(inputs, k) for k in range(num_consts)]
        carry = [value(inputs, k) for k in range(num_consts, first_xs)]
        return consts, carry, [value(inputs, k) for k in other_xs]

    def run(inputs, shards, handover, keep):
        """Forward over the layers: ``(needed outputs, per layer what backward reads)``:
        the residuals kept and the layer's inputs."""
        consts, carry, xs = split(inputs)

        def one_layer(state, scanned):
            carry, whole = state
            i, xs_i = scanned
            ahead = gathered(shards, (i + 1) % length, None)
            ins, ws = [*carry, *xs_i], [*whole, *consts]
            if not keep:
                outs = layer(ins, ws)
                return (outs[:num_carry], ahead), (outs[num_carry:], [])
            outs, vjp_fn = jax.vjp(layer, ins, ws)
            leaves, saved["treedef"] = jax.tree.flatten(vjp_fn)
            recomputed = w_only_residuals(layer, ins, ws)
            # Per residual: None (recomputed from the parameters), ("in", j) (the layer's
            # input j itself, kept once) or ("kept", k).
            kept, saved["source"] = [], []
            for x, r in zip(leaves, recomputed, strict=True):
                j = next((j for j, v in enumerate(ins) if v is x), None)
                if r:
                    saved["source"].append(None)
                elif j is not None:
                    saved["source"].append(("in", j))
                else:
                    saved["source"].append(("kept", len(kept)))
                    kept.append(x)
            return (outs[:num_carry], ahead), (outs[num_carry:], (kept, ins))

        first = gathered(shards, 0, gate(handover, prefetch))
        (carry, _), (ys, held) = lax.scan(one_layer, (carry, first), (jnp.arange(length), xs))
        pick = lambda o: carry[o] if o < num_carry else ys[needed_ys.index(o - num_carry)]  # noqa: E731
        return [pick(o) for o in needed], held

    @jax.custom_vjp
    def step(inputs, shards, handover):
        outputs, _ = run(inputs, shards, handover, keep=False)
        return outputs, handover_vector(inputs, handover, prefetch)

    def forward(inputs, shards, handover):
        outputs, held = run(inputs, shards, handover, keep=True)
        handed = handover_vector(inputs, handover, prefetch)
        return (outputs, handed), (held, list(shards), handover, list(inputs))

    def backward(residuals, cotangents):
        held, shards, handover, inputs = residuals
        output_cts, handover_ct = cotangents
        consts, _, _ = split(inputs)
        # Cotangents of every carry (zero where the loss does not read it) and needed ys;
        # only floating-point ones travel through the scan, the rest are float0 zeros.
        carry_ct = [jnp.zeros(a.shape, a.dtype) if _float(a) else None for a in carry_avals]
        for o, ct in zip(needed, output_cts):
            if o < num_carry and _float(carry_avals[o]):
                carry_ct[o] = ct
        ys_ct = [ct for o, ct in zip(needed, output_cts) if o >= num_carry]
        float_ys = [j for j, a in enumerate(ys_avals) if _float(a)]
        const_cts = [jnp.zeros_like(c) if _float(c) else None for c in consts]

        def layer_backward(state, scanned):
            """Layer ``i``'s backward on its gathered parameters, gathering layer ``i - 1``'s
            meanwhile: ``(state for layer i - 1), (its whole parameter cotangents, xs'
            cotangents)``."""
            carry_ct, whole, const_cts = state
            i, (kept_i, ins_i), ys_ct_i = scanned
            behind = gathered(shards, (i - 1) % length, None, again=True)
            ws = [*whole, *consts]
            source = saved["source"]
            # What depends on the parameters alone is computed again from the gathered ones.
            again = jax.tree.leaves(jax.vjp(layer, ins_i, ws)[1]) if None in source else []
            held_i = {"in": ins_i, "kept": kept_i}
            leaves = [again[k] if s is None else held_i[s[0]][s[1]] for k, s in enumerate(source)]
            vjp_fn = jax.tree.unflatten(saved["treedef"], leaves)
            out_ct = [
                c if c is not None else _zero_cotangent(a) for c, a in zip(carry_ct, carry_avals)
            ]
            ys_full = [_zero_cotangent(a) for a in ys_avals]
            for j, ct in zip(float_ys, ys_ct_i):
                ys_full[j] = ct
            ins_ct, ws_ct = vjp_fn([*out_ct, *ys_full])
            new_carry_ct = [ins_ct[k] if c is not None else None for k, c in enumerate(carry_ct)]
            new_const_cts = [
                None if acc is None else acc + ct
                for acc, ct in zip(const_cts, ws_ct[len(param_at) :])
            ]
            xs_ct = [ins_ct[num_carry + j] for j in range(len(other_xs))]
            xs_ct = [ct if _float(ct) else None for ct in xs_ct]
            return (new_carry_ct, behind, new_const_cts), (ws_ct[: len(param_at)], xs_ct)

        def reduce_scatter(param_cts):
            with jax.named_scope(GRADIENT_SCOPE):
                return scatter(param_cts, dims)

        def scatter_in_turn(state):
            """Each layer's gradient reduce-scattered at the end of its own backward."""

            def one_layer(state, scanned):
                state, (param_cts, xs_ct) = layer_backward(state, scanned)
                return state, (reduce_scatter(param_cts), xs_ct)

            scanned = (jnp.arange(length), held, float_ys_ct)
            return lax.scan(one_layer, state, scanned, reverse=True)

        def scatter_one_behind(state):
            """Layer ``i + 1``'s gradient, ``pending``, reduce-scattered during layer ``i``'s
            backward: a collective that ends inside the iteration that starts it can only
            hide behind compute that does not need its result. The last layer's backward
            runs alone before the scan; layer 0's gradient is scattered after it."""

            def one_layer(state, scanned):
                *state, pending = state
                state, (param_cts, xs_ct) = layer_backward(tuple(state), scanned)
                return (*state, param_cts), (reduce_scatter(pending), xs_ct)

            top = length - 1
            at_top = (top, jax.tree.map(lambda h: h[top], held), [c[top] for c in float_ys_ct])
            state, (pending, top_xs_ct) = layer_backward(state, at_top)
            below = jax.tree.map(lambda h: h[:top], (held, float_ys_ct))
            (*state, pending), (above_cts, xs_cts) = lax.scan(
                one_layer, (*state, pending), (jnp.arange(top), *below), reverse=True
            )
            # ``above_cts[i]`` is layer i + 1's slice; layer 0's was left pending.
            shard_cts = [
                jnp.concatenate([first[None], rest])
                for first, rest in zip(reduce_scatter(pending), above_cts)
            ]
            xs_cts = [
                None if ct is None else jnp.concatenate([rest, ct[None]])
                for rest, ct in zip(xs_cts, top_xs_ct)
            ]
            return tuple(state), (shard_cts, xs_cts)

        last = gathered(shards, length - 1, gate(handover_ct, prefetch), again=True)
        float_ys_ct = [ys_ct[j] for j in float_ys]
        backward_scan = scatter_one_behind if scatter_behind else scatter_in_turn
        (carry_ct, _, const_cts), (shard_cts, xs_cts) = backward_scan((carry_ct, last, const_cts))
        input_cts = [_zero_cotangent(x) if not _float(x) else jnp.zeros_like(x) for x in inputs]
        by_position = {k: c for k, c in enumerate(const_cts)}
        by_position |= {num_consts + k: c for k, c in enumerate(carry_ct)}
        by_position |= {k: c for k, c in zip(other_xs, xs_cts)}
        for k, ct in by_position.items():
            v = eqn.invars[k]
            if ct is not None and is_var(v):
                j = segment.inputs.index(v)
                input_cts[j] = input_cts[j] + ct
        back = handed_back(handover, handover_ct, output_cts, shard_cts, prefetch)
        return input_cts, shard_cts, back

    step.defvjp(forward, backward)
    return step
