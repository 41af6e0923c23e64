"""What both train steps check and default alike: whether the optimizer is one a step can
carry, whether an allreduce can run over the data axes with its options, and whether a step
donates its state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from jaxdist.comm import collectives

__all__ = [
    "WAIT_FREE_UNROLL_LIMIT",
    "check_allreduce",
    "check_optimizer",
    "check_shardable",
    "check_wait_free",
    "donation_default",
]


def check_optimizer(optimizer: Any) -> None:
    """Refuse what is not an optax transformation (such as an ``nnx.Optimizer``, which holds
    its model and state itself; the step keeps the optimizer state, so it takes the optax
    transformation inside)."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    hint = ""
    if hasattr(optimizer, "tx"):
        hint = " (for an nnx.Optimizer(model, tx), pass tx: the step keeps the optimizer state)"
    raise TypeError(f"optimizer must be an optax GradientTransformation with init and update, "
                    f"got {kind}{hint}")  # fmt: skip


def donation_default(mesh: Mesh) -> bool:
    """Whether a step on ``mesh`` should donate its state: yes on accelerators, no on CPU.

    Donation lets XLA write the new state over the old one, which halves the state's device
    memory -- what matters on a GPU or TPU. On the CPU runtime it buys nothing (host memory)
    and costs time: the same step runs measurably slower donated, with the same compiled HLO
    apart from its input/output aliases (benchmarks/results/NOTES_train_step_resnet.md has the figures).
    """
    return any(d.platform != "cpu" for d in mesh.devices.flat)


def check_allreduce(
    mesh: Mesh, axes: str | tuple[str, ...], allreduce: str, options: Mapping[str, Any]
) -> None:
    """Refuse an allreduce that cannot run over ``axes`` of ``mesh`` with ``options``, in one
    line, before anything is traced."""
    chosen = collectives.get(allreduce)
    if chosen.levels > 1 and not (isinstance(axes, tuple) and len(axes) == chosen.levels):
        raise ValueError(f"allreduce {chosen.name!r} needs {chosen.axes_needed('data axes')}, "
                         f"got {axes!r}")  # fmt: skip
    sizes = [mesh.shape[a] for a in np.atleast_1d(axes)]
    if chosen.levels == 1:
        sizes = [int(np.prod(sizes))]
    collectives.common_options(options)
    own = {k: v for k, v in options.items() if k in chosen.options}
    reason = chosen.unsupported(sizes, **own)
    if reason:
        raise ValueError(f"allreduce {chosen.name!r} cannot run over {axes!r}: {reason}")


# A wait-free step paces every message step beside backward compute, which a step inside a
# loop could not be: its schedules run unrolled whatever their length.
WAIT_FREE_UNROLL_LIMIT = 1 << 30


def check_wait_free(wait_free: bool, allreduce: str, zero1: bool, sfb_layers: Any) -> None:
    """Refuse, in one line, a wait-free step that cannot be one: it paces a permute schedule's
    buckets of dense gradients beside the backward pass."""
    if not wait_free:
        return
    if allreduce in ("native", "none"):
        raise ValueError(f"wait_free=True paces the message steps of a permute schedule; "
                         f"allreduce={allreduce!r} has none (choose ring, torus2d, ...)")  # fmt: skip
    problem = "zero1=True" if zero1 else "sfb_layers" if sfb_layers else None
    if problem:
        raise ValueError(f"wait_free=True paces buckets of whole gradients beside backward; "
                         f"it does not combine with {problem}")  # fmt: skip


def _probe_update(optimizer: Any, params: Any, grads: Any) -> Any:
    """Two updates of ``optimizer`` from fresh state (the second sees state the first left)."""
    state = optimizer.init(params)
    first, state = optimizer.update(grads, state, params)
    second, _ = optimizer.update(grads, state, params)
    return first, second


def _probe_trees() -> tuple[dict, dict]:
    """Parameters and gradients to probe with: a kernel (``ndim > 1``, as masks see it) and a
    bias, of unequal norms."""
    rng = np.random.default_rng(0)
    params = {"bias": rng.standard_normal(4), "kernel": rng.standard_normal((3, 4))}
    grads = {"bias": 3 * rng.standard_normal(4), "kernel": rng.standard_normal((3, 4))}
    as32 = lambda tree: {k: np.asarray(v, np.float32) for k, v in tree.items()}  # noqa: E731
    return as32(params), as32(grads)


def check_shardable(optimizer: Any, by: str) -> None:
    """Refuse an optimizer whose update changes when it sees the parameters in parts, as a
    step that shards it does: ``by="elements"`` (ZeRO-1: one flat float32 vector per device,
    so the update must be element-wise, without masks by shape) or ``by="stages"`` (a
    pipeline: one stage's layers at a time, so per-layer rules such as LARS work, but a
    global gradient norm does not). Probed on a small kernel and bias, on the host."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's own
        params, grads = _probe_trees()
        expected = [ravel_pytree(update)[0] for update in _probe_update(optimizer, params, grads)]
        if by == "elements":  # the whole as one flat vector, updated in two slices
            flat_params, flat_grads = ravel_pytree(params)[0], ravel_pytree(grads)[0]
            halves = [_probe_update(optimizer, flat_params[s], flat_grads[s])
                      for s in (slice(0, 8), slice(8, None))]  # fmt: skip
            parts = [jnp.concatenate([half[i] for half in halves]) for i in range(2)]
            what = ("ZeRO-1 updates each device's slice of one flat vector of all parameters, "
                    "so the optimizer must be element-wise (SGD, momentum, Adam; no "
                    "global-norm clipping, no per-layer trust ratios, no masks by shape)")  # fmt: skip
        else:  # each layer updated on its own
            alone = {k: _probe_update(optimizer, {k: params[k]}, {k: grads[k]}) for k in params}
            parts = [ravel_pytree({k: alone[k][i][k] for k in params})[0] for i in range(2)]
            what = ("a pipeline updates each stage's layers on their own, so the update of a "
                    "layer must not depend on the others (per-layer rules such as LARS work; "
                    "a global gradient norm does not: clip per layer, or train data-parallel)")  # fmt: skip
    for got, want in zip(parts, expected, strict=True):
        # Relative to the update's size: a weight decay dropped by a mask is small beside it.
        got, want = np.asarray(got), np.asarray(want)
        if not np.allclose(got, want, rtol=0, atol=1e-6 * np.max(np.abs(want))):
            raise ValueError(f"this optimizer's update changes when it sees the parameters in "
                             f"parts, and {what}")  # fmt: skip
