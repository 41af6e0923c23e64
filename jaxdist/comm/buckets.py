"""Gradient fusion: pack gradients into contiguous buckets in backward order.

One allreduce per parameter pays the per-message latency once per parameter (ResNet-50 has 161
parameter arrays); one allreduce of everything cannot start before the whole backward pass is
done. Buckets sit between the two, as in Horovod's fusion buffer and PyTorch DDP's buckets:

* Parameters are ordered by when backward produces their gradient, which is the reverse of
  when the forward pass first uses them. :func:`backward_order` reads that off the loss
  function's jaxpr, so it is right for any model, whatever the names of its parameters.
* Consecutive gradients in that order are packed until a bucket holds ``bucket_bytes``; each
  bucket is flattened into one buffer and reduced with one schedule, then unpacked.

The first bucket holds the gradients of the *last* layers, which exist first; its allreduce
depends on nothing else, so the scheduler is free to run it while earlier layers are still in
backward (Poseidon's wait-free backprop). Whether it does is up to XLA: docs/train_step.md
shows what the compiled schedule actually contains.

Smaller buckets start earlier and overlap more, but each pays the schedule's latency
(2(p-1) alpha for a ring); larger buckets amortise latency and overlap less.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.comm import collectives

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "bucketed_allreduce",
    "plan_buckets",
]

DEFAULT_BUCKET_BYTES = 16 * 2**20


def backward_order(
    loss_fn: Callable, params: Any, *args: Any, axis_env: Sequence[tuple[str, int]] = ()
) -> list[int]:
    """Indices of ``params``' leaves in the order backward produces their gradients.

    Traces ``loss_fn(params, *args)`` (abstractly, nothing runs) and sorts the parameter leaves
    by their first use in the forward pass, latest first. ``axis_env`` binds the mesh axes the
    loss refers to (e.g. cross-replica BatchNorm). Leaves the loss never reads come last.
    """
    closed = jax.make_jaxpr(loss_fn, axis_env=list(axis_env))(params, *args)
    return backward_order_of_jaxpr(closed.jaxpr, len(jax.tree.leaves(params)))


def backward_order_of_jaxpr(jaxpr: Any, num_leaves: int) -> list[int]:
    """:func:`backward_order` of a loss already traced (a ``jax.make_jaxpr(...).jaxpr``) whose
    first ``num_leaves`` inputs are the parameter leaves: a caller that traces the loss anyway
    need not trace it twice."""
    param_vars = {id(v): k for k, v in enumerate(jaxpr.invars[:num_leaves])}
    first_use = [math.inf] * num_leaves
    for position, eqn in enumerate(jaxpr.eqns):
        for var in eqn.invars:
            k = param_vars.get(id(var))
            if k is not None and first_use[k] == math.inf:
                first_use[k] = position
    used = sorted(
        (k for k in range(num_leaves) if first_use[k] < math.inf), key=first_use.__getitem__
    )
    unused = [k for k in range(num_leaves) if first_use[k] == math.inf]
    return used[::-1] + unused


def plan_buckets(
    sizes_in_bytes: Sequence[int], order: Sequence[int], bucket_bytes: int | None
) -> list[list[int]]:
    """Group leaf indices, taken in ``order``, into buckets of at least ``bucket_bytes`` (the
    last one may be smaller). ``None`` or 0 puts everything in one bucket."""
    if sorted(order) != list(range(len(sizes_in_bytes))):
        raise ValueError(
            f"order must be a permutation of range({len(sizes_in_bytes)}), got {list(order)}"
        )
    if not bucket_bytes:
        return [list(order)] if len(order) else []
    buckets: list[list[int]] = [[]]
    filled = 0
    for k in order:
        if filled >= bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(k)
        filled += sizes_in_bytes[k]
    return buckets


def bucketed_allreduce(
    grads: Any,
    axis_name: collectives.AxisName,
    buckets: Sequence[Sequence[int]],
    algorithm: str | Sequence[str],
    *,
    op: str = "mean",
    passthrough: Sequence[int] = (),
    **options: Any,
) -> Any:
    """Allreduce ``grads`` one bucket at a time (one schedule per bucket and dtype).

    ``algorithm``: one schedule for every bucket, or one per bucket. ``passthrough``: leaf
    indices averaged some other way (sufficient factors), left as they are."""
    leaves, treedef = jax.tree.flatten(grads)
    algorithms = [algorithm] * len(buckets) if isinstance(algorithm, str) else list(algorithm)
    if len(algorithms) != len(buckets):
        raise ValueError(f"{len(buckets)} buckets but {len(algorithms)} algorithms")
    reduced: list[Any] = [None] * len(leaves)
    for k in passthrough:
        reduced[k] = leaves[k]
    for bucket, name in zip(buckets, algorithms):
        results = collectives.allreduce(
            [leaves[k] for k in bucket], axis_name, name, op=op, **options
        )
        for k, leaf in zip(bucket, results):
            reduced[k] = leaf
    missing = [k for k, leaf in enumerate(reduced) if leaf is None]
    if missing:
        raise ValueError(f"buckets do not cover gradient leaves {missing}")
    return jax.tree.unflatten(treedef, reduced)


def leaf_bytes(tree: Any) -> list[int]:
    """Bytes of every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
    return [
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    ]
