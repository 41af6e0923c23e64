"""The pieces a recipe's config names, built: the mesh, the learning-rate schedule, the
optimizer, and what a train step is built from.
Each raises ``ValueError`` naming the config field when a value cannot work.

A field set away from its default that does nothing with the rest of the config (``lr.power``
with a cosine schedule, ``optimizer.trust_coefficient`` with SGD, ``unroll_limit`` with XLA's
own all-reduce) is refused too: the run would silently ignore it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import optax
from jax.sharding import Mesh

from jaxdist import meshes
from jaxdist.run.config import (
    LR_KIND_FIELDS,
    OPTIMIZER_FIELDS,
    SWITCHES,
    at_default,
    base_config,
)
from jaxdist.tasks import Task
from jaxdist.training import global_norm, optim
from jaxdist.training.step_options import Communication, Precision, StateSharding

__all__ = [
    "StepParts",
    "build_lr_schedule",
    "build_mesh",
    "build_optimizer",
    "optimizer_arguments",
    "step_options",
]


def build_mesh(name: str, stages: int = 0) -> Mesh:
    """The recipe's mesh preset (or TOML path); ``""``: all devices, as one ``data`` axis, or
    with ``stages`` pipeline stages as ``data x stage`` (neighbouring stages on neighbouring
    devices)."""
    count = jax.device_count()
    if name:
        spec = meshes.load(name)
        if jax.process_count() > 1 and spec.size != count:
            # A mesh on part of the devices would leave whole processes out of every step.
            raise meshes.MeshDoesNotFitError(
                f"mesh {spec.name!r} ({' x '.join(map(str, spec.shape))} = {spec.size} devices) "
                f"does not match this run: {jax.process_count()} processes with "
                f"{jax.local_device_count()} devices each = {count}. Start processes x devices "
                f"= {spec.size} (srun --ntasks, mpirun -np, jaxdist launch --processes; "
                f"--cpu-devices on CPU), or give a mesh of {count} devices (--set mesh=...)"
            )
        return meshes.build(spec)
    if not stages:
        return meshes.ring(count, axis_name="data")
    if count % stages:
        raise ValueError(
            f"pipeline.stages={stages} does not divide the {count} devices; give "
            "a stage count that does, or a mesh (--set mesh=...)"
        )
    return meshes.pipeline(count // stages, stages)


def refuse_unused(
    section: str, values: ml_collections.ConfigDict, used: tuple[str, ...], chosen: str
) -> None:
    """Refuse a field of ``config.<section>`` outside ``used`` that differs from its default:
    ``chosen`` (e.g. ``"lr.kind='cosine'"``) does not read it."""
    defaults = base_config()[section]
    for field, value in values.items():
        default = defaults[field]
        if field not in used and not at_default(value, default):
            raise ValueError(
                f"{section}.{field}={value!r} does nothing with {chosen}; leave "
                f"it at its default ({default!r}) or choose what reads it"
            )


def build_lr_schedule(config: ml_collections.ConfigDict):
    """``epoch -> learning rate`` from ``config.lr``, ending at ``config.num_epochs``."""
    lr = config.lr
    if lr.kind in LR_KIND_FIELDS:  # an unknown kind is optim.lr_schedule's to name
        used = (*SWITCHES["lr.kind"][1], *LR_KIND_FIELDS[lr.kind])
        refuse_unused("lr", lr, used, f"lr.kind={lr.kind!r}")
    return optim.lr_schedule(
        lr.kind,
        lr.peak,
        lr.warmup_epochs,
        config.num_epochs,
        end_lr=lr.end_lr,
        power=lr.power,
        init_lr=lr.init_lr,
        step_epochs=tuple(lr.step_epochs),
        step_factor=lr.step_factor,
    )


def build_optimizer(
    opt: ml_collections.ConfigDict, initial_lr: float
) -> optax.GradientTransformation:
    """``config.optimizer``'s optimizer, its learning rate a hyperparameter set each step,
    after global-norm clipping when ``clip_norm`` is set."""
    if opt.name not in OPTIMIZER_FIELDS:
        raise ValueError(
            f"optimizer.name must be one of {sorted(OPTIMIZER_FIELDS)}, got {opt.name!r}"
        )
    refuse_unused(
        "optimizer",
        opt,
        (*SWITCHES["optimizer.name"][1], *OPTIMIZER_FIELDS[opt.name]),
        f"optimizer.name={opt.name!r}",
    )
    if opt.clip_norm < 0:
        raise ValueError(f"optimizer.clip_norm must be >= 0 (0: no clipping), got {opt.clip_norm}")
    optimizer = optim.make_optimizer(opt.name, initial_lr, **optimizer_arguments(opt))
    if opt.clip_norm:
        # The norm over the whole model, also where a pipeline updates it stage by stage.
        optimizer = optax.chain(global_norm.clip_by_global_norm(opt.clip_norm), optimizer)
    return optimizer


def optimizer_arguments(opt: ml_collections.ConfigDict) -> dict[str, Any]:
    """The hyperparameters ``config.optimizer`` gives its optimizer: the fields it reads, an
    unset ``eps`` (``None``) as that optimizer's own (:data:`optim.DEFAULT_EPS`)."""
    arguments = {k: opt[k] for k in OPTIMIZER_FIELDS[opt.name]}
    if "eps" in arguments and arguments["eps"] is None:
        arguments["eps"] = optim.DEFAULT_EPS[opt.name]
    return arguments


def sfb_layers_setting(text: str) -> str | tuple[str, ...] | None:
    """``config.sfb_layers`` as :class:`~jaxdist.training.train_step.TrainStep` takes it:
    ``""`` -> None (none; every dense layer a candidate for ``auto``), ``"none"`` -> ``()``,
    ``"all"``, or a tuple of comma-separated module paths."""
    if not isinstance(text, str):
        raise ValueError(
            f"sfb_layers must be a string ('', 'all', 'none' or comma-separated "
            f"module paths), got {text!r}"
        )
    text = text.strip()
    if text in ("", "all"):
        return text or None
    if text == "none":
        return ()
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a recipe's step is built from.

    Attributes:
      task: what is trained (:class:`~jaxdist.tasks.Task`): its loss, or its pipeline stages.
      optimizer: the recipe's optimizer.
      communication, sharding, precision: the recipe's step options, as both steps take
        them (:func:`step_options`).
    """

    task: Task
    optimizer: optax.GradientTransformation
    communication: Communication
    sharding: StateSharding
    precision: Precision


def step_options(
    config: ml_collections.ConfigDict,
) -> tuple[Communication, StateSharding, Precision]:
    """The recipe's fields every step takes: how gradients are averaged and priced, where
    the state lives, and whether non-finite steps are skipped."""
    if config.allreduce == "native" and config.unroll_limit != base_config().unroll_limit:
        raise ValueError(
            f"unroll_limit={config.unroll_limit} shapes the ppermute schedules, "
            "and allreduce='native' is XLA's own all-reduce: choose a schedule "
            "(ring, torus2d, ...) or leave unroll_limit out"
        )
    communication = Communication(
        config.allreduce,
        options={"unroll_limit": config.unroll_limit},
        bucket_bytes=config.bucket_bytes,
        sfb_layers=sfb_layers_setting(config.sfb_layers),
        links=config.links or None,
        wait_free=config.wait_free,
    )
    sharding = StateSharding(
        config.sharding, gather=config.gather or None, prefetch=config.prefetch
    )
    return communication, sharding, Precision(skip_nonfinite=config.skip_nonfinite_steps > 0)
