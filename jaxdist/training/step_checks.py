"""What both train steps check and default alike, once the mesh is known: whether the
optimizer is one a step can carry, whether an allreduce, a sharded state or a tensor split can
run over the mesh's axes with their options (:mod:`jaxdist.training.step_options`), and
whether a step donates its state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from jaxdist.comm import collectives
from jaxdist.training import global_norm
from jaxdist.training.batches import data_share

__all__ = [
    "WAIT_FREE_UNROLL_LIMIT",
    "check_allreduce",
    "check_gather",
    "check_optimizer",
    "check_pacing",
    "check_shardable",
    "check_sharded",
    "check_tensor",
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
    raise TypeError(
        f"optimizer must be an optax GradientTransformation with init and update, got {kind}{hint}"
    )


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
        raise ValueError(
            f"allreduce {chosen.name!r} needs {chosen.axes_needed('data axes')}, got {axes!r}"
        )
    sizes = [mesh.shape[a] for a in np.atleast_1d(axes)]
    if chosen.levels == 1:
        sizes = [int(np.prod(sizes))]
    collectives.common_options(options)
    own = {k: v for k, v in options.items() if k in chosen.options}
    reason = chosen.unsupported(sizes, **own)
    if reason:
        raise ValueError(f"allreduce {chosen.name!r} cannot run over {axes!r}: {reason}")


def check_sharded(
    mesh: Mesh,
    data_axes: Any,
    shard_axes: Any,
    sharding: str,
    allreduce: str,
    options: Mapping[str, Any],
    sfb_layers: Any,
) -> None:
    """Refuse, in one line, a sharded step (ZeRO-1, FSDP) that cannot run: its collectives are
    one schedule's reduce-scatter and all-gather over ``shard_axes``, a subset of the data
    axes."""
    what = f"sharding={sharding!r} reduce-scatters gradients and all-gathers parameters"
    if allreduce in ("auto", "none"):
        raise ValueError(
            f"{what} with one schedule's halves; allreduce={allreduce!r} names none "
            f"(choose one of {', '.join(collectives.SHARDED_ALGORITHMS)})"
        )
    if sfb_layers:
        raise ValueError(f"{what}; it sends no sufficient factors (sfb_layers)")
    shard, data = tuple(np.atleast_1d(shard_axes)), tuple(np.atleast_1d(data_axes))
    if not shard or any(a not in data for a in shard):
        raise ValueError(f"shard_axes must be among the data axes {data}, got {shard}")
    check_allreduce(mesh, shard_axes, allreduce, options)
    chosen = collectives.get(allreduce)
    sizes = [mesh.shape[a] for a in shard]
    sizes = [int(np.prod(sizes))] if chosen.levels == 1 else sizes
    reason = collectives.sharded_unsupported(
        allreduce, tuple(sizes), **{k: v for k, v in options.items() if k in chosen.options}
    )
    if reason:
        raise ValueError(f"{what} with allreduce={allreduce!r}, which cannot: {reason}")


def check_tensor(
    mesh: Mesh, data_axes: Any, tensor: Any, allreduce: str, sfb_layers: Any, wait_free: bool
) -> None:
    """Refuse, in one line, a tensor-parallel step that cannot run: its tensor axis must be
    an axis of the mesh that splits no batch, processes must hold the same replicas as the
    others they share any with (:func:`~jaxdist.training.batches.data_share`), and its
    gradients are averaged by one named schedule (no per-bucket choice, factors or
    wait-free pacing)."""
    if tensor.axis not in mesh.axis_names:
        raise ValueError(
            f"the tensor axis {tensor.axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
        )
    if tensor.axis in np.atleast_1d(data_axes):
        raise ValueError(
            f"the tensor axis {tensor.axis!r} splits weights, not the batch: "
            f"leave it out of the data axes {data_axes!r}"
        )
    # Across processes, a tensor group's processes must be able to read the same rows.
    data_share(mesh, data_axes)
    problem = (
        f"allreduce={allreduce!r}"
        if allreduce in ("auto", "none")
        else "sfb_layers"
        if sfb_layers
        else "wait_free=True"
        if wait_free
        else None
    )
    if problem:
        raise ValueError(
            f"a tensor-parallel step averages its gradients with one named "
            f"schedule; it does not combine with {problem}"
        )


def check_gather(
    mesh: Mesh,
    data_axes: Any,
    shard_axes: Any,
    sharding: str,
    gather: str,
    options: Mapping[str, Any],
) -> None:
    """Refuse, in one line, a parameter all-gather schedule (``gather``) that a step cannot
    run: one with halves, over ``shard_axes``, of a sharded step."""
    if sharding == "replicated":
        raise ValueError(
            f"gather={gather!r} is the schedule of a sharded step's parameter "
            "all-gathers; sharding='replicated' gathers none (choose "
            "sharding='zero1' or 'fsdp')"
        )
    if gather not in collectives.SHARDED_ALGORITHMS:
        raise ValueError(
            f"gather must be one of {', '.join(collectives.SHARDED_ALGORITHMS)}; got {gather!r}"
        )
    try:
        check_sharded(mesh, data_axes, shard_axes, sharding, gather, options, None)
    except ValueError as err:  # its lines name the schedule as the allreduce's
        raise ValueError(f"gather={gather!r}: {err}") from None


def check_pacing(
    prefetch: Any, sharding: str, keep_gathered: bool, scatter_behind: bool = False
) -> None:
    """Refuse the options that pace FSDP's layers where a step cannot honour them:
    ``prefetch`` must be a positive count of layers, and ``prefetch`` other than 1 (the
    default, accepted anywhere) or ``scatter_behind`` needs FSDP's paced layers
    (``sharding="fsdp"`` without ``keep_gathered``)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be a whole number of layers >= 1; got {prefetch!r}")
    if sharding == "fsdp" and not keep_gathered:
        return
    how = "keeps every unit gathered" if keep_gathered else f"sharding={sharding!r} gathers"
    if scatter_behind:
        raise ValueError(
            "scatter_behind=True paces FSDP's gradient reduce-scatters in scanned layers; "
            f"a step that {how} none layer by layer (choose sharding='fsdp' without "
            "keep_gathered, or leave scatter_behind out)"
        )
    if prefetch != 1:
        raise ValueError(
            f"prefetch={prefetch} is how many layers ahead FSDP gathers parameters; "
            f"a step that {how} none layer by layer (choose sharding='fsdp' "
            "without keep_gathered, or leave prefetch=1)"
        )


# A wait-free step paces every message step beside backward compute, which a step inside a
# loop could not be: its schedules run unrolled whatever their length.
WAIT_FREE_UNROLL_LIMIT = 1 << 30


def check_wait_free(wait_free: bool, allreduce: str, sharding: str, sfb_layers: Any) -> None:
    """Refuse, in one line, a wait-free step that cannot be one: it paces a permute schedule's
    buckets of dense gradients beside the backward pass."""
    if not wait_free:
        return
    if allreduce in ("native", "none"):
        raise ValueError(
            f"wait_free=True paces the message steps of a permute schedule; "
            f"allreduce={allreduce!r} has none (choose ring, torus2d, ...)"
        )
    problem = f"sharding={sharding!r}" if sharding != "replicated" else None
    problem = problem or ("sfb_layers" if sfb_layers else None)
    if problem:
        raise ValueError(
            f"wait_free=True paces buckets of whole gradients beside backward; "
            f"it does not combine with {problem}"
        )


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


def check_shardable(optimizer: Any, *, updates_together: bool = True) -> bool:
    """Refuse an optimizer whose update changes when it sees one pipeline stage's layers at a
    time, as a pipeline step updates them: per-layer rules such as LARS work, and so do sums
    over the whole model taken with :func:`~jaxdist.training.global_norm.model_sum`
    (:func:`~jaxdist.training.global_norm.clip_by_global_norm`), which the pipeline adds over
    its stages; a global norm computed otherwise does not. Where the stages do not update
    together (``updates_together=False``: PipeDream) no sum over the model is possible, and
    one is refused. Probed on a small kernel and bias, on the host. Returns whether the
    update sums anything over the whole model."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's own
        params, grads = _probe_trees()
        whole, sums = global_norm.partial_sums(lambda: _probe_update(optimizer, params, grads))
        if any(isinstance(s, jax.core.Tracer) for s in sums):  # it never left a lax.cond
            raise ValueError(
                "the optimizer takes a norm over the model inside a conditional "
                "transformation (optax.apply_if_finite, MultiSteps, ...), where a "
                "pipeline cannot add it over its stages: put the clip outside it, "
                "or use the step's skip_nonfinite"
            )
        expected = [ravel_pytree(update)[0] for update in whole]
        if sums and not updates_together:
            raise ValueError(
                "this optimizer takes a norm over the whole model, and this "
                "schedule updates each stage at its own time, so no step has "
                "every stage's gradient at once: clip per layer, or use a "
                "synchronous schedule (gpipe, 1f1b, interleaved) or pipedream_2bw"
            )
        alone = {
            k: global_norm.with_sums(
                lambda k=k: _probe_update(optimizer, {k: params[k]}, {k: grads[k]}), sums
            )
            for k in params
        }
        parts = [ravel_pytree({k: alone[k][i][k] for k in params})[0] for i in range(2)]
    for got, want in zip(parts, expected, strict=True):
        # Relative to the update's size: a weight decay dropped by a mask is small beside it.
        got, want = np.asarray(got), np.asarray(want)
        if not np.allclose(got, want, rtol=0, atol=1e-6 * np.max(np.abs(want))):
            raise ValueError(
                "this optimizer's update changes when it sees the parameters in "
                "parts, and a pipeline updates each stage's layers on their own, "
                "so the update of a layer must not depend on the others (per-layer "
                "rules such as LARS work; for a global gradient norm use "
                "jaxdist.training.global_norm.clip_by_global_norm, or "
                "optimizer.clip_norm in a recipe, which the pipeline takes over "
                "every stage)"
            )
    return bool(sums)
